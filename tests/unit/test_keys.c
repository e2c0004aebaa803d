/* CURVE keys and the ZAP handler: key files, allow-lists, loopback checks,
 * and real CURVE sockets on loopback (a listed key is admitted under its
 * name, an unlisted one is not, a routing id that is not the key's name is
 * refused, an allow-list edited on disk takes effect). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/keys.h"
#include "common/log.h"
#include "common/util.h"
#include "common/zap.h"
#include "tests/test.h"

static char g_dir[256];

static void path_of(char *out, size_t n, const char *name) {
    snprintf(out, n, "%s/%s", g_dir, name);
}

static void write_file(const char *name, const char *text) {
    char p[512];
    path_of(p, sizeof p, name);
    FILE *f = fopen(p, "w");
    REQUIRE(f);
    fputs(text, f);
    fclose(f);
}

static void test_key_files(void) {
    loom_keypair_t kp, back;
    loom_err_t err = {0};
    REQUIRE(loom_keys_generate(&kp, &err) == LOOM_OK);
    CHECK(loom_key_z85_ok(kp.public_z85) && loom_key_z85_ok(kp.secret_z85));
    CHECK(loom_keys_write(g_dir, "alice", &kp, 0, &err) == LOOM_OK);
    CHECKF(loom_keys_write(g_dir, "alice", &kp, 0, &err) == LOOM_ERR_IO && strstr(err.msg, "--force"), "%s", err.msg);
    CHECK(loom_keys_write(g_dir, "alice", &kp, 1, &err) == LOOM_OK);
    CHECK(loom_keys_write(g_dir, "bad/name", &kp, 0, &err) == LOOM_ERR_INVALID_ARGUMENT);
    char p[512];
    path_of(p, sizeof p, "alice.key");
    struct stat st;
    CHECK(stat(p, &st) == 0 && (st.st_mode & 0777) == 0600);
    CHECK(loom_keypair_read(p, "alice's key", &back, &err) == LOOM_OK);
    CHECK(!strcmp(back.public_z85, kp.public_z85) && !strcmp(back.secret_z85, kp.secret_z85));
    /* the Z85 text itself, as an environment variable holds it */
    CHECK(loom_keypair_read(kp.secret_z85, "alice's key", &back, &err) == LOOM_OK);
    CHECK(!strcmp(back.public_z85, kp.public_z85));
    char pub[LOOM_KEY_Z85 + 1];
    path_of(p, sizeof p, "alice.pub");
    CHECK(loom_key_read(p, "alice's public key", pub, &err) == LOOM_OK && !strcmp(pub, kp.public_z85));
    write_file("junk.key", "# nothing here\n\nnot a key\n");
    path_of(p, sizeof p, "junk.key");
    CHECKF(loom_key_read(p, "the junk key", pub, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "the junk key") &&
               strstr(err.msg, "no 40-character Z85 key"),
           "%s", err.msg);
    CHECKF(loom_key_read("/no/such/file", "the server's key", pub, &err) == LOOM_ERR_INVALID_ARGUMENT &&
               strstr(err.msg, "the server's key"),
           "%s", err.msg);
    /* a path of exactly 40 Z85-alphabet characters is a file, not key text
     * ("/tmp/loom-serve-XXXXXX/keys/worker-0.key" is one) */
    char dir40[32], p40[96];
    snprintf(dir40, sizeof dir40, "/tmp/loom-k40-XXXXXX");
    REQUIRE(mkdtemp(dir40));
    REQUIRE(loom_keys_write(dir40, "w", &kp, 0, &err) == LOOM_OK);
    snprintf(p40, sizeof p40, "%s/w.key", dir40);
    char pad[96];
    snprintf(pad, sizeof pad, "%s/%.*s.key", dir40, (int)(LOOM_KEY_Z85 - strlen(dir40) - 5), "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa");
    REQUIRE(strlen(pad) == LOOM_KEY_Z85 && loom_key_z85_ok(pad));
    REQUIRE(rename(p40, pad) == 0);
    CHECKF(loom_keypair_read(pad, "a 40-character path", &back, &err) == LOOM_OK &&
               !strcmp(back.public_z85, kp.public_z85),
           "%s", err.msg);
    unlink(pad);
    snprintf(p40, sizeof p40, "%s/w.pub", dir40);
    unlink(p40);
    rmdir(dir40);
    /* a cluster's set */
    char set[300];
    path_of(set, sizeof set, "set");
    CHECK(loom_keys_make_set(set, 3, "worker-", 1, 0, 0, &err) == LOOM_OK);
    loom_allow_t a;
    snprintf(p, sizeof p, "%s/workers.allow", set);
    CHECK(loom_allow_load(p, &a, &err) == LOOM_OK && a.n == 3 && !strcmp(a.e[2].name, "worker-2"));
    loom_allow_free(&a);
    snprintf(p, sizeof p, "%s/clients.allow", set);
    CHECK(loom_allow_load(p, &a, &err) == LOOM_OK && a.n == 1 && !strcmp(a.e[0].name, "client-0"));
    loom_allow_free(&a);
}

static void test_allow_list(void) {
    loom_keypair_t k1, k2;
    loom_err_t err = {0};
    loom_keys_generate(&k1, &err);
    loom_keys_generate(&k2, &err);
    char text[512];
    snprintf(text, sizeof text, "# workers\n\nworker-0 %s\n  worker-1   %s  \n", k1.public_z85, k2.public_z85);
    loom_allow_t a;
    REQUIRE(loom_allow_parse(text, strlen(text), "w.allow", &a, &err) == LOOM_OK);
    CHECK(a.n == 2);
    uint8_t bin[32];
    zmq_z85_decode(bin, k2.public_z85);
    CHECK(loom_allow_find(&a, bin) && !strcmp(loom_allow_find(&a, bin), "worker-1"));
    bin[0] ^= 1;
    CHECK(loom_allow_find(&a, bin) == NULL);
    loom_allow_free(&a);
    const char *bad[] = {"worker-0\n", "worker-0 short\n", "a b c\n", "wor/ker %s\n", "w %s extra\n"};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(bad); i++) {
        char line[256];
        snprintf(line, sizeof line, "# first\n");
        size_t n = strlen(line);
        snprintf(line + n, sizeof line - n, bad[i], k1.public_z85);
        CHECKF(loom_allow_parse(line, strlen(line), "w.allow", &a, &err) == LOOM_ERR_FORMAT &&
                   strstr(err.msg, "w.allow:2"),
               "case %zu: %s", i, err.msg);
    }
    snprintf(text, sizeof text, "a %s\nb %s\n", k1.public_z85, k1.public_z85);
    CHECKF(loom_allow_parse(text, strlen(text), "w.allow", &a, &err) == LOOM_ERR_FORMAT &&
               strstr(err.msg, "twice"),
           "%s", err.msg);
}

static void test_endpoints(void) {
    CHECK(loom_endpoint_is_local("tcp://127.0.0.1:5555"));
    CHECK(loom_endpoint_is_local("tcp://127.3.2.1:0"));
    CHECK(loom_endpoint_is_local("tcp://localhost:5555"));
    CHECK(loom_endpoint_is_local("tcp://[::1]:5555"));
    CHECK(loom_endpoint_is_local("ipc:///tmp/x"));
    CHECK(loom_endpoint_is_local("inproc://loom-api"));
    CHECK(!loom_endpoint_is_local("tcp://0.0.0.0:5555"));
    CHECK(!loom_endpoint_is_local("tcp://*:5555"));
    CHECK(!loom_endpoint_is_local("tcp://10.1.2.3:5555"));
    CHECK(!loom_endpoint_is_local("tcp://eth0:5555"));
    CHECK(!loom_endpoint_is_local(NULL));
}

static void *client(void *ctx, const char *addr, const char *id, const loom_keypair_t *kp, const char *server_pub) {
    void *z = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(z, ZMQ_ROUTING_ID, id, strlen(id));
    int keyed = 0;
    loom_err_t err = {0};
    if (kp) CHECK(loom_keys_client(z, server_pub, kp->secret_z85, &keyed, &err) == LOOM_OK && keyed);
    zmq_connect(z, addr);
    zmq_send(z, "hello", 5, 0);
    return z;
}

/* One message within ms: returns 1 with *ok = loom_zap_identity_ok, or 0. */
static int receive(loom_zap_t *z, void *router, int ms, int *ok, char *user, size_t cap) {
    zmq_pollitem_t it = {router, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, ms) <= 0) return 0;
    zmq_msg_t rid, body;
    zmq_msg_init(&rid);
    zmq_msg_init(&body);
    zmq_msg_recv(&rid, router, 0);
    zmq_msg_recv(&body, router, 0);
    const char *u = zmq_msg_gets(&body, "User-Id");
    snprintf(user, cap, "%s", u ? u : "");
    *ok = loom_zap_identity_ok(z, &body, zmq_msg_data(&rid), zmq_msg_size(&rid));
    zmq_msg_close(&rid);
    zmq_msg_close(&body);
    return 1;
}

static void test_zap(void) {
    loom_err_t err = {0};
    loom_keypair_t server, w1, stranger, late;
    loom_keys_generate(&server, &err);
    loom_keys_generate(&w1, &err);
    loom_keys_generate(&stranger, &err);
    loom_keys_generate(&late, &err);
    char text[256], allow[512];
    snprintf(text, sizeof text, "w1 %s\n", w1.public_z85);
    write_file("zap.allow", text);
    path_of(allow, sizeof allow, "zap.allow");
    void *ctx = zmq_ctx_new();
    void *router = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof zero);
    loom_zap_t *z = NULL;
    REQUIRE(loom_zap_create(ctx, &z, &err) == LOOM_OK);
    write_file("broken.allow", "w1 nope\n");
    char broken[512];
    path_of(broken, sizeof broken, "broken.allow");
    CHECKF(loom_zap_secure(z, router, LOOM_ZAP_CONTROL, "worker", &server, broken, &err) == LOOM_ERR_FORMAT &&
               strstr(err.msg, "broken.allow:1"),
           "%s", err.msg);
    REQUIRE(loom_zap_secure(z, router, LOOM_ZAP_CONTROL, "worker", &server, allow, &err) == LOOM_OK);
    REQUIRE(loom_zap_start(z, &err) == LOOM_OK);
    REQUIRE(zmq_bind(router, "tcp://127.0.0.1:*") == 0);
    char addr[128];
    size_t al = sizeof addr;
    zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, addr, &al);

    int ok = 0;
    char user[64];
    void *a = client(ctx, addr, "w1", &w1, server.public_z85);
    CHECK(receive(z, router, 3000, &ok, user, sizeof user) && ok && !strcmp(user, "w1"));
    void *b = client(ctx, addr, "w2", &w1, server.public_z85); /* a listed key under another name */
    CHECK(receive(z, router, 3000, &ok, user, sizeof user) && !ok && !strcmp(user, "w1"));
    void *c = client(ctx, addr, "w3", &stranger, server.public_z85);
    void *d = client(ctx, addr, "w4", NULL, NULL); /* no key at all */
    CHECK(!receive(z, router, 700, &ok, user, sizeof user));
    /* rotation: a key added to the file is admitted without a restart */
    sleep(1);
    snprintf(text, sizeof text, "w1 %s\nw5 %s\n", w1.public_z85, late.public_z85);
    write_file("zap.allow", text);
    usleep(1200 * 1000);
    void *e = client(ctx, addr, "w5", &late, server.public_z85);
    CHECK(receive(z, router, 3000, &ok, user, sizeof user) && ok && !strcmp(user, "w5"));
    unsigned long admitted, refused;
    loom_zap_counts(z, &admitted, &refused);
    CHECKF(admitted == 3 && refused >= 3, "admitted %lu refused %lu", admitted, refused);
    CHECK(loom_zap_identity_ok(NULL, NULL, "x", 1) == 1); /* an unkeyed plane checks nothing */
    void *socks[] = {a, b, c, d, e, router};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(socks); i++) zmq_close(socks[i]);
    loom_zap_stop(&z);
    loom_zap_stop(&z);
    zmq_ctx_term(ctx);
}

int main(void) {
    loom_log_init("test_keys");
    if (!getenv("LOOM_LOG_LEVEL")) loom_log_set_level(LOOM_LOG_ERROR);
    snprintf(g_dir, sizeof g_dir, "/tmp/loom-test-keys-%d", (int)getpid());
    mkdir(g_dir, 0700);
    RUN(test_key_files);
    RUN(test_allow_list);
    RUN(test_endpoints);
    RUN(test_zap);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return test_summary();
}
