"""Run everything in the course that needs a GPU, and pack the results into one archive.

    python scripts/gpu_tour.py --pack DIR     # on a CUDA machine (a 440 s budget, a watchdog)
    python scripts/gpu_tour.py --dry-run      # anywhere: CPU, toy sizes, Triton's interpreter

See kvlab/tour/ (and docs/gpu_tour.md: the one command for a lent machine) for the stages and what
the machine needs.
"""

import sys
from pathlib import Path

try:
    from kvlab.tour.runner import main
except ModuleNotFoundError as error:  # kvlab itself is not installed on this machine
    sys.exit(f"gpu tour: cannot import kvlab ({error}); install it first, offline: "
             f"pip install --no-deps --no-build-isolation --no-index -e .")

if __name__ == "__main__":
    sys.exit(main(repo=Path(__file__).resolve().parents[1]))
