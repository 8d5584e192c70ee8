"""Triton kernels of the course, installed as `kvlab.kernels` (stage 5: paged attention).

Importing this package does not import Triton: stages 0-4 run on machines without it. Modules, in
reading order (the first three need no Triton):

* `pool_layout`: the two block-pool layouts (token-major, head-major), their strides, and which
  addresses one attention program reads under each (the layout picture).
* `split_kv`: how many splits a split-KV (flash-decoding) launch uses.
* `validate`: input checks with the numbers in every message.
* `paged_attention`: the decode kernel (GQA-aware, online softmax, split-KV + reduce).
* `write_kv`: the kernel that stores new K/V at the slot mapping.

Measuring them is tooling beside the course, in `kvlab.tools`: `compiled` (the decode kernel
compiled for a GPU target without one) and the GPU benchmark, `bench_paged_attention` (with
`bench_timing`, `bench_flex` for FlexAttention, `bench_report` for its tables and roofline).

Without a GPU, set TRITON_INTERPRET=1 before Triton is first imported: the kernels then run in
Triton's CPU interpreter (slowly, on small sizes).
"""
