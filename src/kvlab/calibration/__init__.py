"""Fitting the simulation clock to published measurements: a tool beside stage 7, not its lesson.

* `clock`: the `calibrated` clock, stage 7's roofline (`kvlab.serving.cost_model`) derated by
  factors fitted to published measurements of real engines (`calibration.json`, shipped with the
  package), with its residuals; refit with `python -m kvlab.calibration.clock --write`.
* `token_states`: the vLLM paper's figure 2 (the share of reserved KV memory holding token states
  under Orca's reservations and vLLM's blocks) replayed on the one scheduler and clock.

See docs/simulation_clock.md.
"""
