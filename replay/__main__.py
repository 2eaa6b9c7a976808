from replay.cli import run

run()
