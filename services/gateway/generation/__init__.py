"""From one generation request to text deltas: the fan-out of prompts x `n` into
scheduler requests and the max_tokens rule (`fan_out.py`), one choice's scheduler stream
turned into text (`choices.py`) through the shared tokenizer `DecodeStream`
(`decode_mux.py`), and a choice continuing on another replica when its replica goes
away (`migration.py`). It is what the OpenAI and pooling routes call once they have
tokens; which replica serves is `routing/`'s decision."""
