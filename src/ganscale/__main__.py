from ganscale.cli import main

main()
