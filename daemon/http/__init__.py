"""The front's OpenAI-compatible HTTP API and its Prometheus `/metrics` (off unless
`specd --http`).

A thin adapter over the socket's request flow: an HTTP body becomes the same
`messages.Generate` (with its `SamplingParams`) the socket decodes, goes through the same
admission (`RequestFlow.admit`), and its output comes back through an `HttpPeer` in place
of a socket connection. Runs on the front's event loop (aiohttp); imports no torch.

Modules: `listener` (the bound port and the API keys, opened before the front starts),
`params` (OpenAI request bodies -> `Generate`), `responses` (`Final`/`Delta` -> OpenAI
objects and stream chunks), `errors` (OpenAI's error object, statuses), `peer` (one
request's sink), `metrics` (the Prometheus registry), `server` (routes and handlers).
"""
