"""Requests into prompts and tokens back into text: chat-template rendering, structured
output grammars, sampling, reasoning parsers, detokenisation, Unicode and the context window."""
