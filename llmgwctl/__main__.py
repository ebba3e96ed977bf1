from llmgwctl.cli import main
from llmgwctl.cli.completion import COMPLETE_VAR

# The console script's name, so usage lines and shell completion read the same
# whichever way llmgwctl was started.
main(prog_name="llmgwctl", complete_var=COMPLETE_VAR)
