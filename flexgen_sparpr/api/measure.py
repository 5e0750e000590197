"""What a benchmark measures beside an LLM's own Stats (bench/ reaches them here, not in engine/
or storage/): PeakMemory, a block's peak host RSS and GPU memory (`with PeakMemory(device) as
peak: ...; peak.report()`), and disk_bandwidth, a folder's measured read and write speed."""
from __future__ import annotations

from ..engine.memory import PeakMemory  # noqa: F401  (the API's, as LLM.compare measures it)
from ..storage.disk_store import disk_bandwidth  # noqa: F401
