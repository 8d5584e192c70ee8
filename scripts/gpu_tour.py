"""Run everything in the course that needs a GPU, and pack the results into one archive.

    python scripts/gpu_tour.py --pack DIR     # on a CUDA machine (a 540 s budget, a watchdog)
    python scripts/gpu_tour.py --dry-run      # anywhere: CPU, toy sizes, Triton's interpreter

See tools/tour/ (and docs/gpu_tour.md: the one command for a lent machine) for the stages and what
the machine needs.
"""

import sys
from pathlib import Path

try:
    from kvlab.tools.tour.runner import main
except ModuleNotFoundError as error:  # kvlab is not installed: only the install maps tools/
    print(f"gpu tour: error: cannot import kvlab.tools ({error}): kvlab is not installed (it maps "
          f"tools/ to kvlab.tools and kernels/ to kvlab.kernels); install it first, offline: "
          f"pip install --no-deps --no-build-isolation --no-index -e .", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main(repo=Path(__file__).resolve().parents[1]))
