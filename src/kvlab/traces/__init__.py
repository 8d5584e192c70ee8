"""Real request traces shipped with kvlab, and readers for their file formats.

* `azure`: the Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA 2024; CC BY 4.0),
  request sizes: the default workload of `kvlab report`.
* `mooncake`: the Mooncake traces (Qin et al., FAST 2025; Apache-2.0), with the hashes of
  512-token prompt blocks, so prefix reuse is real (stages 6 and 7).
* `load`: `load_trace`, by shipped name or by file (what `kvlab serve` and notebook 07 read).
The files are under `kvlab/traces/data/<trace>/`, with a README or NOTICE giving source and licence.
"""

from .azure import (AZURE_ATTRIBUTION, AZURE_TRACES, TraceFormatError, azure_trace,
                    azure_trace_path, load_azure_trace)
from .load import SHIPPED_TRACES, load_trace
from .mooncake import MOONCAKE_TRACES, MooncakeTrace, load_mooncake_trace

__all__ = ["AZURE_ATTRIBUTION", "AZURE_TRACES", "TraceFormatError", "azure_trace",
           "azure_trace_path", "load_azure_trace", "MOONCAKE_TRACES", "MooncakeTrace",
           "load_mooncake_trace", "load_trace", "SHIPPED_TRACES"]
