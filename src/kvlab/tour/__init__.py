"""The GPU tour: one prepared command that runs everything in the course that needs a GPU.

    python scripts/gpu_tour.py                 # on a CUDA machine: < 6 minutes on an H100/H200
    python scripts/gpu_tour.py --dry-run       # CPU, toy sizes, Triton's interpreter (tested in CI)

Stages, each in its own process so one failure or timeout never stops the others:

* `environment`: the card (name, memory as torch.cuda reports it, compute capability, driver),
  torch / Triton / Python versions, and the card's copy bandwidth measured in the same run.
* `tests`: the tests marked `cuda` (`pytest -m cuda` over the test files that use the mark).
* `benchmarks`: every `kernels/bench_*.py` (stage 5's paged-attention benchmark today).
* `notebooks`: every `notebooks/NN_*.ipynb`, its code cells executed top to bottom without a Jupyter
  kernel (the GPU machine has no Jupyter packages), outputs captured into an executed copy.

Each stage writes a Markdown summary; everything is packed into one .tar.gz. Modules:
`environment` (the card), `notebook_runner` (cells without Jupyter), `stages` (what each stage
runs), `runner` (the command, progress, summary, archive).
"""
