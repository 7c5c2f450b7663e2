"""`python -m workers.sandbox CONFIG`: the sandbox's process (child.py), as launch.py starts it."""

import sys

from workers.sandbox.child import main

main(sys.argv[1:])
