from llmgwctl.cli import main

main()
