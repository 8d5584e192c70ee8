"""The simulation clock fitted to measurements: what `kvlab serve --simulate` reads at run time.

* `clock`: the `calibrated` clock, stage 7's roofline (`kvlab.serving.cost_model`) derated by
  factors fitted to published measurements of real engines (`calibration.json`, shipped with the
  package), with its residuals.

Fitting it, and checking the simulator against measurements, is tooling beside stage 7, not its
lesson: `kvlab.tools.calibration` (the fit, refit with
`python -m kvlab.tools.calibration.fit_clock --write`; a clock for this machine's CPU; the
simulator against vLLM's CPU build; the vLLM paper's figure 2 replayed). See
docs/simulation_clock.md and docs/cpu_clock.md.
"""
