"""The HTTP layer around every route, whatever API it serves: CORS and `X-Request-Id`
with their flags (`cors_request_id.py`), and vLLM's small server routes `/ping`,
`/load`, `/v1/models[/{model}]` with the load counter behind `/load`
(`server_routes.py`), and `X-Pagoda-Api-Server` naming the process that answered under
`--api-server-count` (`api_server_header.py`); a streamed response's body chunks
straight to the server, past the middleware (`direct_body.py`). Who may call is `auth/`; how much a
request may ask, `limits/`."""
