"""molctl: operations tool and proxy for self-hosted Mixture-of-LoRA serving."""

__version__ = "0.1.0"
