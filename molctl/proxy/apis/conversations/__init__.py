"""The Conversations API (/v1/conversations) and `conversation` on POST /v1/responses."""
