"""`specdec serve`: an OpenAI-compatible HTTP server with continuous batching of speculative decoding.

    app = specdec.server.create_app(target, tokenizer, specdec.DraftModel(draft))   # FastAPI
    uvicorn.run(app, host="127.0.0.1", port=8000)

Needs the `server` extra (fastapi, uvicorn, prometheus_client). Design: docs/batching.md.
"""

from specdec.server.app import create_app

__all__ = ["create_app"]
