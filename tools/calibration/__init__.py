"""Fitting the simulation clock to measurements, and checking the simulator against them.

The clock itself, as the simulator reads it, is `kvlab.calibration.clock`. Here:

* `fit_clock`: the `calibrated` clock's factors fitted to the published measurements in
  `calibration.json`, with its residuals; refit with
  `python -m kvlab.tools.calibration.fit_clock --write`.
* `cpu_clock`: a clock for this machine's CPU, fitted by timing kvlab's own model mode
  (`python -m kvlab.tools.calibration.cpu_clock`).
* `against_vllm`: the simulator at that clock against vLLM's CPU build on the stored
  `kvlab compare-vllm` runs (`python -m kvlab.tools.calibration.against_vllm`).
* `token_states`: the vLLM paper's figure 2 (the share of reserved KV memory holding token states
  under Orca's reservations and vLLM's blocks) replayed on the one scheduler and clock.

See docs/simulation_clock.md and docs/cpu_clock.md.
"""
