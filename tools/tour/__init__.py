"""The GPU tour: one prepared command that runs everything in the course that needs a GPU.

    python scripts/gpu_tour.py --pack "$OUT"   # on a CUDA machine: 540 s at most (a watchdog)
    python scripts/gpu_tour.py --dry-run       # CPU, toy sizes, Triton's interpreter (tested in CI)

Stages, each in its own process so one failure or timeout never stops the others:

* `environment`: the card (name, memory as torch.cuda reports it, compute capability, driver),
  torch / Triton / Python versions, and the card's copy bandwidth measured in the same run.
* `cuda_tests`: the tests marked `cuda` (`pytest -m cuda` over the test files that use the mark).
* `benchmarks`: every `tools/bench_*.py` (stage 5's paged-attention benchmark today).
* `oom_story`: stage 7's out-of-memory story on the real allocator.
* `notebooks`: every notebook of the course, one process each, its code cells executed top to
  bottom without a Jupyter kernel (the GPU machine has no Jupyter packages): the GPU edition.

SUMMARY.md is rewritten around every stage and everything is packed into one .tar.gz after each,
because a lent machine hands back only a few files and may stop the command at any time. Modules:
`environment` (the card), `notebook_runner` (cells without Jupyter), `stages` (what each stage
runs, its time limit), `stage_process` (a stage under its limit, the budget's watchdog), `packing`
(the archive; what the device returns), `triton_compat` (the dry run's interpreter fix),
`runner` (the command).
"""
