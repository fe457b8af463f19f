from engram.cli import main

raise SystemExit(main())
