"""The OpenAI-compatible front's library: request parsing (pure, `api`), the continuation rule (pure,
`match`) and the Redis index of live sessions' histories (`index`). The server is services/frontend."""
