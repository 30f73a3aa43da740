"""Training: fine-tune and distill domain drafts (built on serving's engine)."""
