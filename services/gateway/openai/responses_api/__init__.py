"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) on
top of the chat path: the routes and their event stream (`routes.py`), the request and
response objects mapped onto a chat completion (`models.py`, `input_items.py`), the
output items built from the chat path's reasoning and tool-call stages
(`output_items.py`), and the store behind `previous_response_id` (`store.py`: the
cluster's Redis through the kv-cache-manager, shared by every gateway replica). Not to
be confused with `openai/completion_bodies.py`, the response bodies of chat and
completions."""
