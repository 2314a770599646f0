"""The inputs every attention layer needs for one step, under the library's name.

The type lives with the kernels (`pagoda.kernels.attention_metadata`), which import no
library code; the library builds it once per step (`pagoda.worker.input_builder`) and
passes it to the torch path and the kernels alike.
"""

from pagoda.kernels.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
