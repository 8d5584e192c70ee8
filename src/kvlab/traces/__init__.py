"""Real request traces shipped with kvlab, and readers for their file formats.

* `kvlab.traces.azure`: the Azure LLM inference trace 2023 (conversation and code services;
  Patel et al., Splitwise, ISCA 2024; CC BY 4.0) — request sizes, the default workload of
  `kvlab report`.

Each trace's files live under `kvlab/traces/data/<trace>/` with a README giving source and licence.
"""

from .azure import (AZURE_ATTRIBUTION, AZURE_TRACES, TraceFormatError, azure_trace,
                    azure_trace_path, load_azure_trace)

__all__ = ["AZURE_ATTRIBUTION", "AZURE_TRACES", "TraceFormatError", "azure_trace",
           "azure_trace_path", "load_azure_trace"]
