from pagoda.cli import main

main()
