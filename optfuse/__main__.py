"""python -m optfuse"""

from .cli import main

main()
