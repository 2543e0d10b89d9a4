"""Bytes <-> request plans: the ASGI app, the uvicorn protocol, the SSE writer, the server."""
