"""`replay bisect`: narrow a loss spike down to a step window, layers/heads and batches with replays."""
