"""The pooling endpoints (/v1/embeddings, /pooling, /classify, /score, /rerank): their
request bodies (`request_models.py`), routes and response shapes (`routes.py`), and the
fan-out of one request's inputs into scheduler requests whose streams each carry one
vector (`fan_out.py`)."""
