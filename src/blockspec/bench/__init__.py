"""blockspec bench: reproduce the block verification paper's evaluation on real models and data."""
