"""`python -m kvlab.tools.oom_story --out DIR [--dry-run]`: see `kvlab.tools.oom_story.story`."""

from .story import main

if __name__ == "__main__":
    raise SystemExit(main())
