"""Text around the token ids: tokenizer, chat template, stop conditions and tool-call parsing.

Pure apart from loading a tokenizer (`ampd.chat.tokenizer`): no transport, shared state or service.
"""
