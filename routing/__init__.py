"""Routing: learn which draft the target accepts most for each prompt."""
