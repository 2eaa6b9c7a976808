from replay.cli import main

main()
