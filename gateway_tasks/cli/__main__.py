import sys

from gateway_tasks.cli.main import main

sys.exit(main())
