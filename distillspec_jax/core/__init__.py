"""Lowest layer: atomic files and the one validation module every config uses. Imports nothing of ours."""
