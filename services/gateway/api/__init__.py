"""The OpenAI API as data, with no I/O: request parsing and validation (with its field list,
response_format grammars and tool calls), response shapes, the OpenAPI document, and the
request as trace attributes. The HTTP side and the response writer import from here; it
imports nothing else of the gateway."""
