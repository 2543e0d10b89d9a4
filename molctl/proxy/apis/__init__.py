"""Thin translators between the wire shapes (chat, models, Responses) and the pipeline."""
