"""Text around the token ids: tokenizer, chat template, stop conditions and tool-call parsing (pure
apart from loading a tokenizer), and `ampd chat` on top of them: the calculator tool
(`calculator`), a chat session over the coordinator's session API (`client`) and the command (`cli`).
"""
