"""The OpenAI-compatible HTTP API of the gateway (FastAPI on the gateway's event loop).

    schemas.py        the request bodies (pydantic) and the response / chunk shapes
    chat_template.py  the model's chat template, rendered as transformers'
                      apply_chat_template renders it (sandboxed jinja2)
    errors.py         OpenAI's error body, mapped from the gRPC path's PublicError
    app.py            the routes: /v1/models, /v1/completions, /v1/chat/completions
    server.py         uvicorn as a task on the running event loop, beside the gRPC server

Every request becomes a pdmesh.v1.GenerateRequest and goes through the gRPC path's own
validation, routing, migration, detokenization and stop strings
(GatewayServicer.open_stream -> replies); nothing of the request pipeline is copied here.
"""
