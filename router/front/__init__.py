"""The router's HTTP front: the OpenAI-compatible endpoints, request bodies and response shapes,
streaming, the HTTP side of tenants and versions, metrics; refusals become HTTP errors here."""
