cat > count_lines.sh <<'SH'
#!/usr/bin/env bash
shopt -s nullglob
files=("$1"/*.txt)
if [ ${#files[@]} -eq 0 ]; then echo 0; else cat "${files[@]}" | wc -l; fi
SH
chmod +x count_lines.sh
