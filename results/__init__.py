"""`make results`: the papers' headline results reproduced at laptop scale with the product's own commands."""
