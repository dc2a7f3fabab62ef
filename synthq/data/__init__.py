"""Conversations and examples, pure: dataset rows, templates rendered, tokens, loss masks."""
