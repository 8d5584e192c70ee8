"""Stage 7 on a GPU: a server with no KV memory manager runs into `torch.OutOfMemoryError`.

    python -m kvlab.tools.oom_story --out DIR [--dry-run]     # the GPU tour's `oom_story` step

A demonstration beside the textbook path (`kvlab.serving` is what stage 7 teaches): the naive
server and paged + prefix serve one real burst at a real model shape, under one lowered
gpu_memory_utilization. Modules, in reading order:

* `story`: the command: the model, the burst, the limit, the two runs, the record.
* `naive`: `NaiveManager` / `NaiveExecutor`, one KV tensor per request; the allocator decides, and
  its refusal is caught, reported, and never harms a running request.
* `allocator`: the one place the allocator's books are read (`cuda_figures`, `run_peaks`), the
  "asked > most it could hand out" sentence (`OutOfMemoryReport`), and `ByteLimit` for the CPU.
* `report`: the record as lines, Markdown, and the GPU tour's headline.
"""
