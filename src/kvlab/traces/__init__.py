"""Real request traces shipped with kvlab, and readers for their file formats.

* `kvlab.traces.azure`: the Azure LLM inference trace 2023 (conversation and code services;
  Patel et al., Splitwise, ISCA 2024; CC BY 4.0) — request sizes, the default workload of
  `kvlab report`.
* `kvlab.traces.mooncake`: the Mooncake traces (Qin et al., FAST 2025; Apache-2.0) — sizes,
  arrivals and the hashes of 512-token prompt blocks, so prefix reuse is real (stages 6 and 7).
* `kvlab.traces.load`: `load_trace`, a trace by shipped name or by file, in either format (what
  `kvlab serve` and notebook 07 read).

Each trace's files live under `kvlab/traces/data/<trace>/` with a README or NOTICE giving source
and licence.
"""

from .azure import (AZURE_ATTRIBUTION, AZURE_TRACES, TraceFormatError, azure_trace,
                    azure_trace_path, load_azure_trace)
from .load import SHIPPED_TRACES, load_trace
from .mooncake import MOONCAKE_TRACES, MooncakeTrace, load_mooncake_trace

__all__ = ["AZURE_ATTRIBUTION", "AZURE_TRACES", "TraceFormatError", "azure_trace",
           "azure_trace_path", "load_azure_trace", "MOONCAKE_TRACES", "MooncakeTrace",
           "load_mooncake_trace", "load_trace", "SHIPPED_TRACES"]
