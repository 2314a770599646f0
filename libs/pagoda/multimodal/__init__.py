"""Multi-modal inputs (images first; video and audio fit the same shapes).

* `inputs`: `MultiModalFeature`, one media item of one prompt after the HF processor.
  It rides on `EngineCoreRequest.mm_features` into the scheduler (block hashes, encoder
  budget) and on to the worker (vision encoder, encoder cache).
* `processing`: the one function the offline `LLM` and the tokenizer service both call to
  turn (prompt, media, mm_processor_kwargs) into expanded prompt token ids and features.

Importing this package costs no torch; `processing` imports it only when it runs.
"""

from pagoda.multimodal.inputs import IMAGE, MODALITIES, MultiModalFeature

__all__ = ["IMAGE", "MODALITIES", "MultiModalFeature"]
