"""Fitting the simulation clock to measurements: a tool beside stage 7, not its lesson.

* `clock`: the `calibrated` clock, stage 7's roofline (`kvlab.serving.cost_model`) derated by
  factors fitted to published measurements of real engines (`calibration.json`, shipped with the
  package), with its residuals; refit with `python -m kvlab.calibration.clock --write`.
* `cpu_clock`: a clock for this machine's CPU, fitted by timing kvlab's own model mode
  (`python -m kvlab.calibration.cpu_clock`).
* `against_vllm`: the simulator at that clock against vLLM's CPU build on the stored
  `kvlab compare-vllm` runs (`python -m kvlab.calibration.against_vllm`).
* `token_states`: the vLLM paper's figure 2 (the share of reserved KV memory holding token states
  under Orca's reservations and vLLM's blocks) replayed on the one scheduler and clock.

See docs/simulation_clock.md and docs/cpu_clock.md.
"""
