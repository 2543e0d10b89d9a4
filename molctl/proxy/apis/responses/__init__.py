"""The Responses API: `protocol` (parsing), `convert` (input and tools), `events`, `handlers`."""
