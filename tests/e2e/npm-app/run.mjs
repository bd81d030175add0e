// The npm package test: APP_DIR holds this folder's index.html and `npm install`ed the tarball.
// Serves it, opens it in Chromium, and checks the generated tokens against the native engine.
import assert from 'node:assert/strict';
import path from 'node:path';
import { startServer } from '../server.mjs';
import { launch } from '../browser.mjs';
import { ROOT, nativeTokens } from '../common.mjs';

const app = process.argv[2];
const prompt = 'Hello world, this is';
const want = nativeTokens(path.join(ROOT, 'models/rand-llama-moe.les'), prompt, 8, ['--memory-budget', '1GiB'], { LES_NO_SIMD: '1' });
const { server, port } = await startServer(0, { root: app });
const ctx = await launch();
try {
  const page = await ctx.newPage();
  await page.goto(`http://127.0.0.1:${port}/?${new URLSearchParams({ model: '/models/rand-llama-moe.les', prompt, n: '8' })}`);
  await page.waitForFunction(() => window.result, null, { timeout: 120_000 });
  const r = await page.evaluate(() => window.result);
  assert.equal(r.error, undefined, r.error);
  assert.deepEqual(r.tokens, want);
  assert.equal(r.chatObject, 'chat.completion');
  console.log(`npm package: ${r.tokens.length} tokens equal the native engine's: ${JSON.stringify(r.text)}`);
} finally {
  await ctx.close();
  server.close();
}
