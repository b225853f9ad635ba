#!/usr/bin/env bash
# Vendor the ipywidgets JavaScript so that built pages render widgets with no network.
# Fetches pinned packages from the npm registry into _vendor/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=_vendor/widgets
if [ -f "$dest/embed-amd.js" ] && [ -f "$dest/require.min.js" ]; then exit 0; fi
tmp=$(mktemp -d)
npm install --silent --no-audit --no-fund --prefix "$tmp" @jupyter-widgets/html-manager@1.0.6 requirejs@2.3.7 >/dev/null
mkdir -p "$dest"
cp "$tmp"/node_modules/@jupyter-widgets/html-manager/dist/*.js "$dest"/
cp "$tmp"/node_modules/@jupyter-widgets/html-manager/dist/*.{woff,woff2,eot,svg,ttf} "$dest"/ 2>/dev/null || true
cp "$tmp"/node_modules/requirejs/require.js "$dest"/require.min.js
rm -rf "$tmp"
echo "vendored widget JS into $dest"
