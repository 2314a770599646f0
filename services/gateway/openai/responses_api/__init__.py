"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) on top of the
chat path: the routes and their event stream (`routes.py`), the request and response
objects mapped onto a chat completion (`models.py`), and the bounded in-memory store
behind `previous_response_id` (`store.py`). Not to be confused with
`openai/completion_bodies.py`, the response bodies of chat and completions."""
