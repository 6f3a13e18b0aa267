from fusedattn.cli import main

raise SystemExit(main())
